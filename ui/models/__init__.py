"""Qt item models: glue that forwards a manager's changes to views; they own no state."""
