"""The ``pdpatch`` command: ``doctor`` and the small tools operators need."""

from __future__ import annotations

import argparse
import sys


def _doctor(args: argparse.Namespace) -> int:
    from pdpatch import doctor

    return doctor.run(as_json=args.json, check_targets=not args.no_import)


def version_text() -> str:
    """``pdpatch --version``: the distribution that provides this package, or where it runs
    from when no distribution does (a source tree on ``sys.path``)."""
    from pdpatch import provenance

    return "pdpatch " + (provenance.installed_as() or
                         f"(not installed as {provenance.DIST}: {provenance.PACKAGE_DIR})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdpatch", description=__doc__)
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="what pdpatch would patch here, and why not")
    doc.add_argument("--json", action="store_true", help="machine-readable output")
    doc.add_argument("--no-import", action="store_true",
                     help="do not import vLLM to check that each patch target exists")
    doc.set_defaults(func=_doctor)
    from pdpatch.hashing import commands as hash_commands

    hash_commands.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
