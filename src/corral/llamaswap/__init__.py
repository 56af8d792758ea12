"""llama-swap's config format, mapped onto Corral's, so its users can switch with the file they
have: `corral serve --config llama-swap.yaml`. Every key is either mapped or reported as ignored
with the reason (`corral config check` prints both; docs/llama-swap.md lists them all).

- `text.py`: ${env.*}, macros, comments in `cmd`, filters, and `Mapping` (what became of each key);
- `devices.py`: groups, the routing section (groups, matrix, scheduler priorities) and peers;
- `convert.py`: detection, the conversion, and loading with line numbers.
"""

from corral.llamaswap.convert import convert, load_any, load_config_file, looks_like_llama_swap
from corral.llamaswap.text import Mapping

__all__ = ["Mapping", "convert", "load_any", "load_config_file", "looks_like_llama_swap"]
