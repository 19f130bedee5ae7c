"""The Ray Data stage classes, their rows, the read + expansion and actor placement; imports none of its modules."""
