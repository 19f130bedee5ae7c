"""The Ray Data stage classes (actor-pool UDFs), their rows, the read + expansion; imports none of its modules."""
