"""``python -m sketchprop.train [overrides]``: fine-tune a GLUE task (:mod:`sketchprop.glue.train`).

    python -m sketchprop.train task=cola model=roberta-base method=gaussian method.rho=0.1
    python -m sketchprop.train -m method.rho=0.5,0.2,0.1 task=cola,mrpc      # a sweep
"""

import sys

from .glue.setup import choose_setup
from .glue.train import main

if __name__ == "__main__":
    sys.argv[1:] = choose_setup(sys.argv[1:])
    main()
