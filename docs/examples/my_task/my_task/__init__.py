"""A researcher's own task for sparsecomm's study tools: ``--task my_task.tasks:build``."""
