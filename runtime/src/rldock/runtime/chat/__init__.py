"""A conversation as the policy sees it: chat rendering into token ids (conversation.py), the tool-call and
reasoning parsers by format (parsers.py), and a turn cut at a weight update and resumed (cut_turns.py).
Read by data/ (prompts), agent/ (the episode loop) and gateway/ (a harness's requests) alike."""
