"""python3 -m bico.llm: see bico.llm.command."""
import sys

from .command import main

sys.exit(main())
