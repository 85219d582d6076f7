"""``python -m service.cli``: the ``tidal`` command."""

from service.cli.main import main

main()
