"""One-click coding-agent setup: write each agent's own config to point at FreeToken, with backup and undo."""
