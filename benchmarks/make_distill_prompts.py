"""Writes benchmarks/distill-prompts.txt, the prompts the shipped adapter was distilled on: the
built-in training prompts plus 58 topics x 20 task templates, with the held-out eval prompts left
out, shuffled with a fixed seed. Run from the repository root: python benchmarks/make_distill_prompts.py
"""
import random
topics = ["volcanoes", "the moon", "honeybees", "ancient Rome", "coffee", "chess", "rain forests", "electric cars",
 "the human heart", "jazz music", "glaciers", "the printing press", "sharks", "recycling plastic", "the Olympic Games",
 "sourdough bread", "earthquakes", "penguins", "the stock market", "origami", "wind turbines", "the Silk Road",
 "dinosaurs", "meditation", "smartphones", "the Amazon river", "vaccines", "castles", "tea ceremonies",
 "deserts", "owls", "the immune system", "board games", "coral reefs", "the Renaissance", "rockets",
 "gardening", "friendship", "public libraries", "chocolate", "trains", "the ocean tides", "mushrooms", "photography",
 "the Great Wall of China", "robots", "snow", "migrating birds", "soap", "maps", "bridges", "pirates", "yoga",
 "clouds", "the alphabet", "elephants", "traffic lights", "paper money"]
templates = ["Explain {t} to a ten-year-old.", "Write a short poem about {t}.", "Give me three interesting facts about {t}.",
 "What are the pros and cons of {t}?", "Tell me a short story that involves {t}.", "Describe {t} in a few sentences.",
 "Why do people care about {t}?", "Write a haiku about {t}.", "What is the history of {t}, briefly?",
 "How would you teach a friend about {t}?", "List five words that come to mind when you think of {t}.",
 "Write a short dialogue between two people talking about {t}.", "What questions might a scientist ask about {t}?",
 "Summarise what most people know about {t}.", "Write a product description for a book about {t}.",
 "What is a common misconception about {t}?", "Write a limerick about {t}.",
 "How might {t} change in the next fifty years?", "Compare {t} with something similar.",
 "Write a friendly tweet about {t}."]
prompts = [tpl.format(t=t) for t in topics for tpl in templates]
base = open("rsd_cli/prompts/train.txt").read().splitlines()
evals = set(open("rsd_cli/prompts/eval.txt").read().splitlines())
out = [p for p in base + prompts if p not in evals]
random.Random(0).shuffle(out)
open("benchmarks/distill-prompts.txt", "w").write("\n".join(out) + "\n")
print(len(out))
