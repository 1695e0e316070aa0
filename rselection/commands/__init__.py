"""The subcommands of the ``rselection`` command line (see :mod:`rselection.cli`)."""
