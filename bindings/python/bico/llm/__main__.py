"""python3 -m bico.llm: see bico.llm.command.  Without torch (or numpy)
one line says which interpreter has them instead of a traceback."""
import sys

try:
    from .command import main
except ImportError as e:
    from .._deps import missing
    missing(e, "python3 -m bico.llm")

sys.exit(main())
