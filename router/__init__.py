"""The front door: sticky routing of users to the node that owns them."""

__version__ = "0.1.0"
