import sys

from deepspeed_xla.bench.cli import main

sys.exit(main())
