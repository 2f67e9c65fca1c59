"""providerd: serve GPU model providers on demand, the systemd way."""

__version__ = "0.1.0"
