import os
import sys

# tests/models.py is shared by test modules; make it importable as `models`.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
