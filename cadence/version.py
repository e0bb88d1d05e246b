"""Cadence's version, importable without the package's lazy `Engine`."""

__version__ = "0.1.0"
