"""The fx2xla version (packages record it)."""
__version__ = "0.1.0"
