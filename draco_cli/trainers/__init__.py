"""Adapters that hand draco's token advantages to a trainer, keyed on per-row ids.

Each submodule imports its trainer (and torch) only when used, so ``import draco_cli`` and
``import draco_cli.trainers`` never import torch. Install the trainers with the
``trainers`` extra (see docs/trainers.md).
"""
