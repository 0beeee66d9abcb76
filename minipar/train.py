"""``python -m minipar.train``: the one training command for every layout, :mod:`minipar.production.train` (the command's short name)."""
import sys

from .production import train as _train

if __name__ == "__main__":
    sys.exit(_train.main())
sys.modules[__name__] = _train   # ``import minipar.train`` is the module itself
