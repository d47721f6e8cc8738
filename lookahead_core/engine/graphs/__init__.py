"""The compiled graphs: the only traced code (step.py), their shapes, inputs, packages and compile workers."""
