"""FTW (FreeToken Weights): the on-disk package the engine memory-maps. See docs/ftw-format.md.

    from runtime.ftw.reader import FTWPackage, FTWError      # open and read a package
    from runtime.ftw.converter import convert, ProgressEvent  # Hugging Face folder -> package
    from runtime.ftw.verify import verify                     # recompute the checksums
"""
