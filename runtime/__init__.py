"""The inference engine. Never imports app or ui; Qt only in the worker's transport module."""
