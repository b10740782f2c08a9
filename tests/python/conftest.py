"""The Python tests run with the build tree's package on PYTHONPATH (ctest sets it) and
Debian's PyTorch (/usr/bin/python3). They write volumes under pytest's tmp_path."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # gpt.py, worker.py
