"""Stage 01's parts: conversation sources, the chat template and loss masks, generation through the target."""
