"""The subcommands of the ``rselection`` command line (assembled by :mod:`rselection.cli`).

One module per subcommand (``status``, ``migrate``, ``resign``, ``forget``, ``demo``),
each with ``add_parser(subparsers)`` and ``run(args) -> int``. They are clients of the
backends' admin APIs (:class:`~rselection.postgres.PostgresAdmin`,
:class:`~rselection.redis.RedisAdmin`) and keep the command line's own jobs: options,
output and exit codes. What they share lives in modules named for it:
:mod:`~rselection.commands.connections` (finding and connecting to the servers,
redacting passwords), :mod:`~rselection.commands.options` (shared options) and
:mod:`~rselection.commands.output` (exit codes, times, tables). The demo's node program
and :class:`~rselection.commands.demo_fleet.Fleet` are in
:mod:`~rselection.commands.demo_fleet`.
"""
