"""The package version, importable without importing the package (training records it)."""

__version__ = "0.1.0"
