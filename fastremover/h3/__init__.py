"""The MiniMax-H3 video decoder command (`fastremover h3-decode`); the model is fastremover/models/h3_decoder.py."""
