"""What runs in which dtype: the cast lists and table, the O1 policy and its engines, boundary casts, O2's loss
regions."""
