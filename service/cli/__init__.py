"""The ``tidal`` command line: one module per noun (jobs, nodes, queues, ``up``),
the shared options and output in :mod:`service.cli.common` and :mod:`service.cli.output`;
:func:`service.cli.main.main` is the console script.
"""
