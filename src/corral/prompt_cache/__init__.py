"""Prompt caches kept across swaps: the conversations a model's server holds, saved
to a folder Corral owns before the server stops and restored after it starts again.

- `keys`: what a conversation is, as cumulative digests, so that two requests' shared prefix
  is found without keeping their text;
- `states`: the saved states on disk, their index, budget and lifetime;
- `slots`: llama-server's slot API (save, restore, erase, list).
"""
