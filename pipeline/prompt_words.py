"""The words epd-bench builds its random prompts from. The random-shape
checkpoints' tokenizer (models/shape_tokenizer.py) holds each as one token,
so a bench prompt of N words is N tokens there; both import it from here,
since a model needs no benchmark."""

WORDS = (
    "the of and to in is that it was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use each which "
    "she do how their if will up other about out many then them these so some her would "
    "make like him into time has look two more write go see number no way could people my "
    "than first water been call who oil its now find long down day did get come made may part"
).split()
