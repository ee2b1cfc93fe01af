"""Images in: the controller's side of vision-language models.

``images`` checks what a client sends (decodable, a supported format, within the size and count limits) and
turns it into the request's typed ``Image``s; ``prompt`` runs mlx-vlm's processor on the controller, so the
prompt reaches every rank as token ids (each image's placeholder tokens expanded as the processor expands
them), and only the first stage, which runs the vision tower, processes the pixels again.
"""
