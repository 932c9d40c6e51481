"""The embedding arena: one preallocated buffer per encoder, carved into
blocks, indexed by content hash, handed to consumers by offset."""
