"""What a run reports: the meter, progress, timeline and the summary; imports none of its modules."""
