"""The trainer side: the snapshot engine that copies a rank's state into its agent's slot in the
background, the checkpointer the training loop calls, restore on (re)start, process-group set-up."""
