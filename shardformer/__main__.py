"""``python -m shardformer ...`` is the ``shardformer`` command."""

import sys

from shardformer.cli.main import main

sys.exit(main())
