"""The subcommands of the ``rselection`` command line (assembled by :mod:`rselection.cli`).

One module per subcommand (``status``, ``migrate``, ``resign``, ``forget``, ``demo``),
each with ``add_parser(subparsers)`` and ``run(args) -> int``; what they share lives in
modules named for it: :mod:`~rselection.commands.connections` (finding and connecting
to the servers, redacting passwords), :mod:`~rselection.commands.options` (shared
options), :mod:`~rselection.commands.leases` (reading a lease table) and
:mod:`~rselection.commands.output` (exit codes, times, tables). The demo's node
program and :class:`~rselection.commands.demo_fleet.Fleet` are in
:mod:`~rselection.commands.demo_fleet`.
"""
