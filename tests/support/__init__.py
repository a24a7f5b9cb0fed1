"""Support modules the tests share (importable as ``support.<name>``: ``tests`` is on the
path). Test modules import helpers from here, never from other test modules."""
