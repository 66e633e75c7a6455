"""Bundled benchmark prompts, written originally for this project (not taken from any dataset).

Each workload stresses speculative decoding differently:

* ``chat``: short everyday questions and instructions (science, history, advice, definitions, how-to, small
  creative requests), each answerable in a paragraph. Free-form text with little overlap with the prompt.
* ``code``: programming requests (Python functions, explaining a snippet, SQL, shell one-liners, regular
  expressions, small algorithms). Outputs are syntax-heavy and fairly predictable.
* ``json``: structured-output requests whose exact expected structure is spelled out in the prompt. Outputs
  repeat key names and punctuation, which draft models and n-gram lookup predict well.
* ``rewrite``: prompts that quote a source text (prose of 80-250 words or a code file of 15-40 lines) and ask
  for a rewrite, grammar fix, summary, tone change or code edit. Outputs copy large spans of the prompt, the
  case where prompt-lookup (n-gram) drafting shines.

``mixed`` (see :func:`prompts_for`) is every prompt of every workload, in the order above.
"""

from __future__ import annotations

import textwrap


def _quoted(instruction: str, source: str, lang: str | None = None) -> str:
    """Join an instruction and a dedented source text (fenced as code when ``lang`` is given) into one prompt."""
    body = textwrap.dedent(source).strip()
    if lang is not None:
        body = f"```{lang}\n{body}\n```"
    return f"{instruction}\n\n{body}"


CHAT: tuple[str, ...] = (
    "Explain in three sentences why the sky is blue.",
    "What is the capital of France, and what is it famous for?",
    "Give me three tips for writing clean Python code.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "What is the difference between a list and a tuple in Python?",
    "Write a short poem about the ocean.",
    "How does a bicycle stay upright when it is moving?",
    "List five fruits that are rich in vitamin C.",
    "What causes the seasons on Earth?",
    "Describe how to make a cup of tea, step by step.",
    "Why do cats purr?",
    "Explain what a hash table is to a beginner.",
    "What are the main causes of climate change?",
    "Write a friendly email inviting a colleague to lunch.",
    "How do vaccines train the immune system?",
    "What is the Pythagorean theorem? Give an example.",
    "What is photosynthesis, and why does it matter for life on Earth?",
    "Why was the Great Wall of China built, and over how many centuries was it constructed?",
    "Give me four practical tips for sleeping better.",
    "Define the word 'serendipity' and use it in a sentence.",
    "How do I fix a flat tyre on a bicycle? Keep it to one paragraph.",
    "Write a haiku about autumn leaves.",
    "What was the Renaissance, and where did it begin?",
    "How does compound interest work? Give a simple numerical example.",
    "Suggest a gentle weekly plan for someone who wants to start running.",
    "Why does ice float on water?",
    "Write a two-sentence story about a lighthouse keeper who finds a message in a bottle.",
    "What is the difference between weather and climate?",
    "How do noise-cancelling headphones work?",
    "Explain what inflation is and why central banks try to control it.",
)

CODE: tuple[str, ...] = (
    "Write a Python function `is_palindrome(s: str) -> bool` that ignores case, spaces and punctuation. "
    "Include two example calls and their results.",
    _quoted(
        "Explain what this Python snippet does, step by step, and say exactly what it prints:",
        """
        nums = [3, 1, 4, 1, 5, 9, 2, 6, 8, 4]
        evens = sorted({n for n in nums if n % 2 == 0}, reverse=True)
        print(evens, len(evens))
        """,
        lang="python",
    ),
    "Given tables `customers(id, name, country)` and `orders(id, customer_id, total, created_at)`, write an SQL "
    "query that returns each country's total order value for the year 2023, highest first. Explain the join.",
    "Give a shell one-liner that counts how many lines in all `.py` files under the current directory (recursively) "
    "contain the word TODO, and explain each part of the pipeline.",
    "Write a regular expression that matches ISO 8601 calendar dates such as 2024-03-15 (four-digit year, month "
    "01-12, day 01-31), explain each part, and show how to use it with Python's `re.fullmatch`.",
    "Implement binary search in Python as `def binary_search(items: list[int], target: int) -> int`, returning the "
    "index of `target` in the sorted list or -1. Explain why it runs in O(log n) time.",
    _quoted(
        "Why does this function give surprising results when it is called more than once? Show a fixed version.",
        """
        def add_item(item, bucket=[]):
            bucket.append(item)
            return bucket
        """,
        lang="python",
    ),
    "Using only the Python standard library, write a function `average_score(path: str) -> float` that reads a CSV "
    "file with a header row `name,score` and returns the mean score, skipping rows whose score is empty.",
    "Write a JavaScript function `debounce(fn, delayMs)` and explain, with an example, when you would use it.",
    "Explain the difference between `git merge` and `git rebase`, and give a short example command sequence for each.",
    "Write a Python generator `chunks(seq, size)` that yields successive lists of length `size` from `seq` (the last "
    "one may be shorter). Add a doctest showing `list(chunks([1, 2, 3, 4, 5], 2))`.",
    _quoted(
        "What is the time complexity of this function, and how could it be made faster? Show the improved version.",
        """
        def has_duplicates(values):
            for i in range(len(values)):
                for j in range(i + 1, len(values)):
                    if values[i] == values[j]:
                        return True
            return False
        """,
        lang="python",
    ),
    "Write a Python function that returns the n-th Fibonacci number using recursion and `functools.lru_cache`, "
    "and explain why the cache makes it fast.",
    "Write a small Python class `Stack` with `push`, `pop`, `peek` and `is_empty` methods, where `pop` and `peek` "
    "raise `IndexError` with a clear message when the stack is empty.",
    _quoted(
        "Explain in plain words what this SQL query returns, clause by clause:",
        """
        SELECT department, COUNT(*) AS staff, ROUND(AVG(salary), 2) AS avg_salary
        FROM employees
        WHERE hired_on >= '2020-01-01'
        GROUP BY department
        HAVING COUNT(*) > 5
        ORDER BY avg_salary DESC;
        """,
        lang="sql",
    ),
)

JSON_OUTPUT: tuple[str, ...] = (
    "Invent a fictional book and describe it as a JSON object with exactly these keys: `title` (string), `author` "
    "(string), `year` (integer), `genres` (array of strings), `available` (boolean). Output only the JSON.",
    _quoted(
        "Convert the following text into a JSON array of objects with exactly the keys `name` (string), `role` "
        "(string) and `start_year` (integer), one object per person, in the order they appear. Output only the JSON.",
        """
        The project team has three members. Ana is the lead engineer and joined in 2019. Tomas has worked as a
        designer since 2021. Priya, the data analyst, started in 2022.
        """,
    ),
    _quoted(
        "Convert this table into a JSON array of objects with the keys `planet` (string), `moons` (integer) and "
        "`has_rings` (boolean), keeping the row order. Output only the JSON.",
        """
        | Planet  | Moons | Rings |
        |---------|-------|-------|
        | Mercury | 0     | no    |
        | Venus   | 0     | no    |
        | Earth   | 1     | no    |
        | Mars    | 2     | no    |
        """,
    ),
    _quoted(
        "Fill in this JSON template for the city of Tokyo. Keep the keys exactly as they are, give "
        "`population_millions` as a number and list exactly three landmarks. Output only the JSON.",
        """
        {
          "city": "",
          "country": "",
          "population_millions": 0,
          "official_language": "",
          "landmarks": ["", "", ""]
        }
        """,
    ),
    "Give a simple pancake recipe as JSON with exactly this structure: "
    '{"name": string, "servings": integer, "prep_minutes": integer, '
    '"ingredients": [{"item": string, "quantity": string}], "steps": [string]}. Output only the JSON.',
    _quoted(
        "Extract the information in these notes into JSON with exactly this structure: "
        '{"date": "YYYY-MM-DD", "attendees": [string], "decisions": [string], '
        '"action_items": [{"owner": string, "task": string, "due": "YYYY-MM-DD"}]}. Output only the JSON.',
        """
        Planning call on 2024-05-06 with Ruth, Kenji and Lucia. We decided to move the newsletter to a monthly
        schedule and to drop the printed edition. Kenji will draft the June issue by 2024-05-20, and Lucia will
        update the subscriber list by 2024-05-13.
        """,
    ),
    "Write an example weather report as JSON with exactly these keys: `location` (string), `temperature_c` "
    '(number), `conditions` (one of "sunny", "cloudy", "rain", "snow"), and `forecast` (an array of exactly three '
    "objects, each with `day` (string), `high_c` (number) and `low_c` (number)). Output only the JSON.",
    _quoted(
        "Convert this CSV into a single JSON object keyed by `sku`, where each value is an object with the keys "
        "`name` (string), `price` (number) and `in_stock` (integer). Output only the JSON.",
        """
        sku,name,price,in_stock
        A-100,Desk lamp,24.99,12
        A-101,Notebook,3.50,240
        B-200,Office chair,149.00,4
        B-201,Monitor stand,39.95,0
        """,
    ),
    _quoted(
        "Classify the sentiment of each review and answer with a JSON array of objects with exactly the keys `id` "
        '(integer), `sentiment` ("positive", "negative" or "neutral") and `confidence` (number between 0 and 1). '
        "Output only the JSON.",
        """
        1. The blender is powerful and easy to clean. Love it.
        2. Arrived two weeks late and the lid was cracked.
        3. It works. Nothing special, nothing wrong.
        4. Battery life is far better than advertised.
        5. Customer support never answered my emails.
        """,
    ),
    "Produce an example configuration for a small web server as JSON with exactly these keys: `host` (string), "
    "`port` (integer), `tls` (object with `enabled` (boolean) and `cert_path` (string)), and `routes` (array of "
    "at least three objects with `path` (string), `handler` (string) and `methods` (array of strings)). Output only "
    "the JSON.",
    _quoted(
        "Convert this YAML document into equivalent JSON, keeping key order. Output only the JSON.",
        """
        service: image-resizer
        version: 3
        replicas: 2
        resources:
          cpu: "500m"
          memory: "256Mi"
        env:
          - name: MAX_WIDTH
            value: "2048"
          - name: OUTPUT_FORMAT
            value: "webp"
        """,
        lang="yaml",
    ),
    _quoted(
        "Turn this to-do list into JSON with exactly this structure: "
        '{"todos": [{"id": integer, "task": string, "priority": "low" | "medium" | "high", "done": boolean}]}, '
        "numbering ids from 1. Items marked [x] are done. Output only the JSON.",
        """
        [x] Renew library card (low)
        [ ] Book dentist appointment (high)
        [ ] Replace kitchen light bulb (medium)
        [x] Send birthday card to grandma (high)
        [ ] Sort out the garage shelves (low)
        """,
    ),
)

_PROSE_REWRITES: tuple[str, ...] = (
    _quoted(
        "Fix the grammar, spelling and punctuation in this email. Keep the wording, tone and structure otherwise "
        "unchanged, and return the full corrected email:",
        """
        Hi team,

        I wanted to let everyone know that the quarterly review have been moved to next thursday at 2pm, because
        the main conference room are being repainted on wednesday. Please bring you're updated project timelines
        and a short list of risks that you think we should discuss. If you cant attend, send me a short update by
        wednesday evening so I can include it in the slides. Their will be coffee and pastries, so dont have a big
        lunch beforehand. Also, a reminder that the new expense policy start on the first of next month; any
        receipts submitted after that date needs to be uploaded through the new portal rather then emailed to
        finance. Let me know if you has any questions.

        Thanks,
        Jordan
        """,
    ),
    _quoted(
        "Rewrite this product description in a formal, professional tone suitable for a printed catalogue. Keep "
        "every product fact (capacity, times, numbers, features, warranty) exactly as given:",
        """
        Meet the Brewmaster 300, the kettle that basically does everything except drink the tea for you! It boils
        a full 1.7 litres in like three minutes, which is seriously fast. There are five temperature presets so
        your green tea doesn't get scorched and your coffee comes out just right. The keep-warm mode holds the
        water hot for up to 30 minutes, so no more reboiling when you get distracted. The body is brushed
        stainless steel and the handle stays cool, so you won't burn your fingers. It shuts off on its own if it
        boils dry, which is a nice safety thing. The base spins all the way around, so lefties and righties are
        both happy. Cleaning is easy too: the limescale filter pops out and goes right in the dishwasher. It comes
        with a two-year warranty, no questions asked.
        """,
    ),
    _quoted(
        "Rewrite this note as a clear, professional company announcement with proper capitalisation and full "
        "sentences. Keep every date, name, address and floor number exactly as given:",
        """
        hey all!! so big news, we're finally moving out of the old building. movers come friday 14 june, so pack
        your desks up by thursday at 5. boxes are in the kitchen, grab as many as u need and label them with your
        name + new floor. new address is 42 harbour road, 3rd and 4th floor. engineering + design on 3, everyone
        else on 4. parking is under the building, passes get handed out monday 17 june at reception. the wifi
        will have the same name and password so laptops should connect on their own. no one's in the office on
        friday, work from home that day. the old kitchen fridge will be emptied thursday afternoon, anything left
        gets thrown out. questions -> ask sam in facilities. cant wait to see everyone in the new place!!
        """,
    ),
    _quoted(
        "Rewrite this notice in plain, friendly English. Keep all of the information and present it in the same order:",
        """
        In accordance with the provisions set out in section 4 of the tenancy agreement, it is hereby notified
        that the annual inspection of the premises will be conducted by a representative of the management
        company on or about the fifteenth day of the month of March. Residents are requested to ensure that
        access to all rooms, including but not limited to the kitchen, bathroom and any storage areas, is made
        available for the duration of the aforementioned inspection. In the event that a resident is unable to be
        present at the property during the scheduled inspection period, it is requested that written
        notification of such unavailability be provided to the management office no later than seven days prior
        to the inspection date, whereupon alternative arrangements may be made at the discretion of the
        management company. Failure to provide access without prior notification may result in the rescheduling
        of the inspection at a time determined solely by the management company.
        """,
    ),
    _quoted(
        "Clean up these meeting notes into tidy minutes: fix spelling and capitalisation, expand abbreviations, "
        'and keep every point and number. Use bulleted lists under the headings "Attendees", "Discussion" and '
        '"Actions":',
        """
        mtg notes - website redesign - tues
        present: lena, marco, aisha, dev
        - lena showed new homepage mockups, every one liked the bigger search bar but felt hero image to busy
        - marco says the product pages load slow on mobile, avg 4.2s, target is under 2s. thinks images arent
          compressed
        - aisha: blog migration 70% done, remaining posts have broken image links, needs help from dev
        - agreed to drop the animated banner, its distracting + slows page
        - dev will setup image cdn by next fri
        - launch date still 1st of sept but might slip if cdn takes longer
        - next mtg tues same time, lena to share revised hero image b4 then
        """,
    ),
    _quoted(
        "Rewrite this paragraph in the third person, about a beekeeper named Alex. Change only what is needed for "
        "the change of person and keep everything else word for word:",
        """
        I started keeping bees three summers ago, after a neighbour offered me an old wooden hive she no longer
        needed. The first year I made nearly every mistake possible: I opened the hive too often, I wore dark
        clothes, and I harvested far too much honey in late summer, leaving my colony short of food for winter.
        Somehow they survived. In my second year I joined a local beekeeping club, where I learned to read the
        frames, spot a queen, and recognise the early signs of swarming. I also started keeping a notebook,
        writing down the weather, the temperament of the bees, and what I saw on each frame. This year I have two
        healthy hives and I took a modest harvest of about twelve jars. My plan for next spring is to raise a
        queen of my own and, if all goes well, to split the stronger colony into a third hive.
        """,
    ),
    _quoted(
        "Convert every British spelling in this text to American spelling. Change nothing else, and return the "
        "full text:",
        """
        The neighbourhood centre will host a colourful festival this autumn to celebrate the town's
        two-hundredth anniversary. The organisers have planned a programme of theatre performances, a travelling
        exhibition about local labour history, and a catalogue of photographs donated by residents. Visitors are
        encouraged to travel by bus, as parking near the centre will be limited. A licensed cafe will serve
        savoury pastries and flavoured lemonade, and a small jewellery market will be open in the courtyard.
        Children can join a modelling workshop, where they will learn to shape clay into their favourite animals.
        The organisers apologise for any inconvenience caused by road closures, and they have analysed last
        year's feedback to improve signage and accessibility. Anyone wishing to volunteer should fill in the
        enquiry form at the reception desk by the end of September.
        """,
    ),
    _quoted(
        "Rewrite this complaint so that it is polite and professional but still firm. Keep every quantity, date "
        "and request exactly as given:",
        """
        To whoever handles orders,

        Your last delivery was a mess. We ordered 40 boxes of A4 paper and 12 toner cartridges on the 3rd and got
        25 boxes of paper and no toner at all. Nobody called to tell us. The driver showed up two hours late and
        left the pallet in the rain, so four of the boxes are soaked and useless. This is the third time this year
        something like this has happened. We need the missing 15 boxes and the 12 cartridges by Friday, plus 4
        replacement boxes for the wet ones, and we are not paying the delivery charge for this order. If this
        keeps happening we will find another supplier. Send me a reply today saying when it will be fixed.

        Office Manager, Northfield Dental Clinic
        """,
    ),
)

_SUMMARIES: tuple[str, ...] = (
    _quoted(
        "Summarise the following article in exactly three bullet points:",
        """
        After decades of decline, overnight sleeper trains are returning to European railways. In the 2000s and
        2010s, many national operators closed their night services, arguing that cheap flights and high-speed day
        trains had made them unprofitable. Since then, several things have changed. Travellers concerned about
        the climate impact of short flights have started looking for alternatives, and some governments have
        begun to discourage domestic flights on routes where a train journey of a few hours exists. Operators
        have responded by reviving old routes and launching new ones, linking cities such as Vienna, Paris,
        Brussels, Berlin and Amsterdam. The trains themselves are also improving: newer carriages offer small
        private compartments with locks, power sockets and showers, designed to appeal to travellers who once
        found couchettes uncomfortable. Challenges remain. Night trains compete for tracks that are busy with
        freight at night, track access charges vary widely from country to country, and rolling stock is
        expensive to buy for a service that runs only once a day in each direction. Ticket prices are often
        higher than budget flights, and some routes have been cancelled again after a single season. Still,
        supporters argue that with coordinated timetables and fairer pricing, overnight rail could become a
        normal way to cross the continent.
        """,
    ),
    _quoted(
        'Summarise these minutes as two short bulleted lists headed "Decisions" and "Action items (with owner)":',
        """
        Minutes of the Maple Street Community Garden committee, held in the library meeting room. Seven members
        attended. The treasurer reported a balance of 1,840 dollars, including a 500 dollar grant from the city's
        green spaces fund that must be spent on water infrastructure by the end of the year. After discussion,
        the committee agreed to use the grant for two new rain barrels and a drip irrigation line for the raised
        beds along the east fence, at an estimated cost of 460 dollars. Members raised concerns that the tool
        shed lock was broken again; Dana offered to replace it with a combination lock before the weekend. The
        waiting list for plots now has fourteen names. The committee voted to divide the two largest plots in
        half, creating two extra plots, and the secretary will contact the first two people on the list. A
        proposal to keep chickens on site was postponed until the spring meeting, pending a check of local
        rules, which Omar agreed to research. The autumn harvest fair will be held on the last Saturday of
        September; volunteers are needed for the produce stall and the children's seed-planting table. The
        meeting closed after one hour.
        """,
    ),
    _quoted(
        "Write a two-sentence summary of these release notes for non-technical users:",
        """
        TaskFlow 2.4 release notes. This release focuses on speed and reliability. Boards with more than 500
        cards now open up to three times faster, thanks to a new loading strategy that fetches cards in the
        background while you scroll. Offline mode has been rewritten: changes made without a connection are now
        stored safely on your device and synced automatically when you reconnect, and conflicts are shown side
        by side so you can choose which version to keep. We have added a dark theme, which follows your system
        setting by default and can be changed under Settings, Appearance. Recurring tasks can now repeat on
        specific weekdays, for example every Monday and Thursday. Notifications are grouped by board, so you no
        longer receive a separate alert for every comment in a busy discussion. Bug fixes include: attachments
        larger than 20 MB no longer fail silently; due dates are now shown correctly in time zones with
        half-hour offsets; and the search box no longer loses focus after the first character on some tablets.
        Support for the legacy version 1 API will end in six months; integrations should move to the version 2
        API before then.
        """,
    ),
    _quoted(
        "Summarise this passage in two sentences:",
        """
        Before the middle of the fifteenth century, books in Europe were copied by hand, usually by scribes
        working in monasteries or, increasingly, in professional workshops in the growing towns. A single copy of
        a long text could take months to produce, and books were correspondingly rare and costly. Around 1450,
        Johannes Gutenberg, a goldsmith in Mainz, combined several existing technologies into a practical
        printing system: movable metal type cast in a hand mould, an oil-based ink that adhered to metal, and a
        screw press similar to those used to make wine and paper. His best-known work, a Latin Bible, was
        completed around 1455. The technique spread rapidly. Within fifty years, printing shops had been
        established in more than two hundred European towns, and millions of books had been produced. Cheaper
        books helped literacy to spread beyond the clergy and the wealthy, allowed scholars in different cities
        to work from identical texts, and made it far harder for authorities to suppress ideas once they had
        been printed. Historians still debate how much credit belongs to Gutenberg personally, but few dispute
        that printing changed European intellectual life.
        """,
    ),
)

_CODE_EDITS: tuple[str, ...] = (
    _quoted(
        "Rename the variable `tmp` to `totals_by_region` everywhere in this module. Change nothing else and return "
        "the complete file:",
        """
        import csv


        def load_totals(path):
            tmp = {}
            with open(path, newline="") as handle:
                reader = csv.DictReader(handle)
                for row in reader:
                    region = row["region"].strip()
                    amount = float(row["amount"])
                    if region not in tmp:
                        tmp[region] = 0.0
                    tmp[region] += amount
            return tmp


        def top_regions(path, count=3):
            tmp = load_totals(path)
            ranked = sorted(tmp.items(), key=lambda item: item[1], reverse=True)
            return ranked[:count]


        def print_report(path):
            for region, total in top_regions(path):
                print(f"{region:<20} {total:>12,.2f}")
        """,
        lang="python",
    ),
    _quoted(
        "Add complete type hints (Python 3.10 syntax) to every function in this module. Do not change any logic "
        "and return the complete file:",
        """
        from collections import Counter


        def word_frequencies(text, stopwords=None):
            stopwords = stopwords or set()
            words = [w.strip(".,;:!?").lower() for w in text.split()]
            return Counter(w for w in words if w and w not in stopwords)


        def most_common_words(text, limit=10, stopwords=None):
            counts = word_frequencies(text, stopwords)
            return [word for word, _ in counts.most_common(limit)]


        def average_word_length(text):
            words = [w for w in text.split() if w.isalpha()]
            if not words:
                return 0.0
            return sum(len(w) for w in words) / len(words)


        def longest_words(text, count=5):
            unique = {w.lower() for w in text.split() if w.isalpha()}
            return sorted(unique, key=lambda w: (-len(w), w))[:count]
        """,
        lang="python",
    ),
    _quoted(
        "Add Google-style docstrings to this class and to each of its methods, documenting arguments, return "
        "values and raised exceptions. Do not change the code itself, and return the complete file:",
        """
        class BankAccount:
            def __init__(self, owner, balance=0.0):
                if balance < 0:
                    raise ValueError("opening balance cannot be negative")
                self.owner = owner
                self.balance = balance
                self.history = []

            def deposit(self, amount):
                if amount <= 0:
                    raise ValueError("deposit must be positive")
                self.balance += amount
                self.history.append(("deposit", amount))

            def withdraw(self, amount):
                if amount <= 0:
                    raise ValueError("withdrawal must be positive")
                if amount > self.balance:
                    raise ValueError("insufficient funds")
                self.balance -= amount
                self.history.append(("withdraw", amount))

            def statement(self):
                lines = [f"Account holder: {self.owner}"]
                for kind, amount in self.history:
                    lines.append(f"{kind:<10}{amount:>10.2f}")
                lines.append(f"{'balance':<10}{self.balance:>10.2f}")
                return lines
        """,
        lang="python",
    ),
    _quoted(
        "In this module, change `MAX_RETRIES` to 5, `TIMEOUT_SECONDS` to 30 and the version in `USER_AGENT` to "
        "1.1. Change nothing else and return the complete file:",
        """
        import time
        import urllib.error
        import urllib.request

        MAX_RETRIES = 3
        TIMEOUT_SECONDS = 10
        BACKOFF_FACTOR = 2.0
        USER_AGENT = "status-checker/1.0"


        def fetch(url):
            request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
            delay = 1.0
            for attempt in range(1, MAX_RETRIES + 1):
                try:
                    with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
                        return response.status, response.read()
                except urllib.error.URLError as error:
                    if attempt == MAX_RETRIES:
                        raise RuntimeError(f"giving up on {url} after {attempt} attempts") from error
                    time.sleep(delay)
                    delay *= BACKOFF_FACTOR


        def check_all(urls):
            results = {}
            for url in urls:
                try:
                    status, _ = fetch(url)
                    results[url] = status
                except RuntimeError:
                    results[url] = None
            return results
        """,
        lang="python",
    ),
    _quoted(
        "Users report that page 1 skips the first results and the last page is always empty. Find and fix the "
        "bug in this module, changing as little as possible, and return the complete corrected file:",
        """
        import math


        def page_count(total_items, page_size):
            if page_size <= 0:
                raise ValueError("page_size must be positive")
            return math.ceil(total_items / page_size)


        def paginate(items, page, page_size=10):
            # Pages are numbered from 1.
            pages = page_count(len(items), page_size)
            if page < 1 or page > pages:
                return []
            start = page * page_size
            end = start + page_size
            return items[start:end]


        def page_summary(items, page, page_size=10):
            chunk = paginate(items, page, page_size)
            if not chunk:
                return "No results on this page."
            first = (page - 1) * page_size + 1
            last = first + len(chunk) - 1
            return f"Showing {first}-{last} of {len(items)} results"
        """,
        lang="python",
    ),
    _quoted(
        "Convert this class into a `@dataclass` (import it from `dataclasses`), removing the hand-written "
        "`__init__`, `__repr__` and `__eq__` but keeping the other methods unchanged. Use "
        "`field(default_factory=list)` for `tags`. Return the complete file:",
        """
        class Book:
            def __init__(self, title, author, year, isbn, tags=None):
                self.title = title
                self.author = author
                self.year = year
                self.isbn = isbn
                self.tags = tags if tags is not None else []

            def __repr__(self):
                return (
                    f"Book(title={self.title!r}, author={self.author!r}, "
                    f"year={self.year!r}, isbn={self.isbn!r}, tags={self.tags!r})"
                )

            def __eq__(self, other):
                if not isinstance(other, Book):
                    return NotImplemented
                return (self.title, self.author, self.year, self.isbn, self.tags) == (
                    other.title, other.author, other.year, other.isbn, other.tags
                )

            def is_classic(self, current_year=2024):
                return current_year - self.year >= 50

            def add_tag(self, tag):
                if tag not in self.tags:
                    self.tags.append(tag)
        """,
        lang="python",
    ),
    _quoted(
        "Replace every `print` call in this module with logging through a module-level "
        "`logger = logging.getLogger(__name__)`, using `warning`, `info` or `error` as appropriate and keeping the "
        "messages. Change nothing else and return the complete file:",
        """
        import json
        import shutil
        from pathlib import Path


        def backup_config(source, backup_dir):
            source = Path(source)
            backup_dir = Path(backup_dir)
            if not source.exists():
                print(f"Config file {source} not found, skipping backup")
                return None
            backup_dir.mkdir(parents=True, exist_ok=True)
            target = backup_dir / (source.name + ".bak")
            shutil.copy2(source, target)
            print(f"Backed up {source} to {target}")
            return target


        def load_config(path):
            try:
                with open(path) as handle:
                    config = json.load(handle)
            except json.JSONDecodeError as error:
                print(f"ERROR: could not parse {path}: {error}")
                return {}
            print(f"Loaded {len(config)} settings from {path}")
            return config


        def update_setting(path, key, value):
            config = load_config(path)
            old = config.get(key)
            config[key] = value
            with open(path, "w") as handle:
                json.dump(config, handle, indent=2)
            print(f"Changed {key}: {old!r} -> {value!r}")
        """,
        lang="python",
    ),
    _quoted(
        "Replace every `var` in this JavaScript file with `const`, or with `let` where the variable is reassigned. "
        "Change nothing else and return the complete file:",
        """
        var TAX_RATE = 0.2;
        var FREE_SHIPPING_THRESHOLD = 50;

        function cartTotals(items) {
          var subtotal = 0;
          for (var i = 0; i < items.length; i++) {
            var item = items[i];
            subtotal += item.price * item.quantity;
          }
          var shipping = subtotal >= FREE_SHIPPING_THRESHOLD ? 0 : 4.99;
          var tax = subtotal * TAX_RATE;
          var total = subtotal + shipping + tax;
          return {
            subtotal: Math.round(subtotal * 100) / 100,
            shipping: shipping,
            tax: Math.round(tax * 100) / 100,
            total: Math.round(total * 100) / 100,
          };
        }

        function formatTotals(totals) {
          var lines = [];
          for (var key in totals) {
            lines.push(key + ": " + totals[key].toFixed(2));
          }
          return lines.join(", ");
        }
        """,
        lang="javascript",
    ),
    _quoted(
        "`expired_items` returns the fresh items instead of the expired ones. Fix that bug, and also add an entry "
        'for "eggs" with a shelf life of 21 days. Change nothing else and return the complete file:',
        """
        from datetime import date, timedelta

        SHELF_LIFE_DAYS = {"milk": 7, "bread": 4, "cheese": 30, "yogurt": 14}


        class PantryItem:
            def __init__(self, name, bought_on, quantity=1):
                self.name = name
                self.bought_on = bought_on
                self.quantity = quantity

            def expires_on(self):
                days = SHELF_LIFE_DAYS.get(self.name, 10)
                return self.bought_on + timedelta(days=days)

            def is_expired(self, today=None):
                today = today or date.today()
                return self.expires_on() > today


        def expired_items(items, today=None):
            return [item for item in items if item.is_expired(today)]


        def use(items, name, amount=1):
            for item in sorted(items, key=lambda i: i.bought_on):
                if item.name != name or amount == 0:
                    continue
                taken = min(item.quantity, amount)
                item.quantity -= taken
                amount -= taken
            return [item for item in items if item.quantity > 0]
        """,
        lang="python",
    ),
)

REWRITE: tuple[str, ...] = _PROSE_REWRITES + _SUMMARIES + _CODE_EDITS

WORKLOADS: dict[str, tuple[str, ...]] = {
    "chat": CHAT,
    "code": CODE,
    "json": JSON_OUTPUT,
    "rewrite": REWRITE,
}

ALL: tuple[str, ...] = CHAT + CODE + JSON_OUTPUT + REWRITE


def prompts_for(workload: str) -> tuple[str, ...]:
    """Return the prompts of ``workload`` (a key of :data:`WORKLOADS`, or ``"mixed"`` for all of them)."""
    if workload == "mixed":
        return ALL
    try:
        return WORKLOADS[workload]
    except KeyError:
        choices = ", ".join([*WORKLOADS, "mixed"])
        raise ValueError(f"unknown workload {workload!r}; choose one of: {choices}") from None
