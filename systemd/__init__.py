"""The systemd unit template and environment example, shipped as package data.

Not code: ``qlora-supervise install-systemd`` reads ``qlora-supervise@.service`` and
``qlora-supervise.env.example`` from here with :mod:`importlib.resources`, so that an installed
wheel has them as well as a clone."""
