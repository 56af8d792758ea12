"""The model servers Corral ships, as processes of their own: the simulated llama-server
(`sim_server`: OpenAI's, Anthropic's and Ollama's shapes, slots and sleep, with realistic
load and token times) and the embeddings server (`embed_server`). Nothing of Corral's scheduler
or gateway runs in them."""
