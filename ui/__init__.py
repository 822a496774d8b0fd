"""PySide6 views that render app/ state and send intents."""
