"""The long-running supervisor. It never imports torch: it must survive what kills the trainer."""

__version__ = "0.1.0"
