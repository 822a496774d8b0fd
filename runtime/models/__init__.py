"""One small file per architecture family, over shared blocks."""
