"""The gateway's front doors: the HTTP routes of each API Corral speaks (OpenAI's, Ollama's,
llama-swap's, the Batch API, the admin routes and the dashboard) and the app that mounts them.
A door parses and answers; it hands each call to the pipeline."""
