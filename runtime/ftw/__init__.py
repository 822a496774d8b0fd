"""FTW (FreeToken Weights): the on-disk package the engine memory-maps. See docs/ftw-format.md."""
