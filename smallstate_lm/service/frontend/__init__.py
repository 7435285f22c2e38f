"""A front-end process: HTTP, body decoding and validation, limits and early refusals, preparing work (vocabulary
ids, tries, the n-gram of lists, lattice parsing), and after the engine's answer ranking, confidences and the
response. Several run side by side on one listening socket; each serves every route. A request goes routes ->
inputs -> submit -> the engine (client) -> results -> responses."""
