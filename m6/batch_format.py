"""The model input's conventions, shared by the data code that writes batches and the model and
loss that read them (a leaf module: it imports nothing, so both sides may depend on it)."""

SEG_PAD, SEG_SOURCE, SEG_TARGET = 0, 1, 2  # padding; prefix (bidirectional, no loss); target (causal, loss)
IGNORE_INDEX = -100  # label of a position without a loss target (cross_entropy's default ignore_index)
