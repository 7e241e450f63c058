"""``python -m openenv_grpc`` is the ``openenv-grpc`` command."""

import sys

from openenv_grpc.cli import main

sys.exit(main())
