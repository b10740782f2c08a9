"""The Python tests run with Debian's PyTorch (/usr/bin/python3) and find the package
`memascend` as any program does: ctest puts the build tree's package on PYTHONPATH; after
`pip install .` (./run downstream) they import the installed one. With
MEMASCEND_TEST_INSTALLED=DIR the run stops unless memascend is imported from under DIR.
They write volumes under pytest's tmp_path."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # gpt.py, worker.py

_INSTALLED = os.environ.get("MEMASCEND_TEST_INSTALLED")


def pytest_configure(config):
    config.addinivalue_line("markers", "last: run after every other test of the session (the "
                            "heaviest: a device call cut short loses the fewest results)")
    if not _INSTALLED:
        return
    import memascend
    where = os.path.realpath(memascend.__file__)
    if not where.startswith(os.path.realpath(_INSTALLED) + os.sep):
        raise pytest.UsageError(f"memascend was imported from {where}, not from the "
                                f"installation under {_INSTALLED} (MEMASCEND_TEST_INSTALLED)")


def pytest_report_header(config):
    if _INSTALLED:
        import memascend
        return f"memascend {memascend.__version__} from {os.path.dirname(memascend.__file__)}"
    return None


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)  # stable
