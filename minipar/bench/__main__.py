"""``python -m minipar.bench NAME [options]``: run one benchmark (``--help`` lists them)."""
import importlib
import pkgutil
import sys

import minipar.bench as _pkg


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(_pkg.__path__)
                  if m.name not in ("common", "__main__") and not m.name.startswith("_"))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nbenchmarks: " + ", ".join(available()))
        return 0
    name = argv.pop(0)
    if name not in available():
        print(f"unknown benchmark {name!r}; available: {', '.join(available())}", file=sys.stderr)
        return 2
    importlib.import_module(f"minipar.bench.{name}").main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
