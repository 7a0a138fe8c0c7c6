"""recipes/mnist_onecycle.py --predict: digits in PNG and JPEG files, white on black or dark ink on paper."""

import pytest
import torch
from conftest import load_recipe, synthetic_digits
from torchvision.io import write_jpeg, write_png

RECIPE = "mnist_onecycle"
mnist = load_recipe(RECIPE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, mnist_dir):
    """A model that knows the synthetic digits of conftest.py (class k: a bright square at k's place)."""
    from common.cli import run_recipe

    run_dir = tmp_path_factory.mktemp("mnist_predict")
    try:
        run_recipe(mnist.main, ["--epochs", "4", "--batch-size", "32", "--width", "8", "--data-dir", str(mnist_dir),
                                "--run-dir", str(run_dir)])
    except SystemExit as exit_:
        assert exit_.code in (0, None)
    return run_dir / "checkpoints" / "last.pt"


def one_digit_per_class(seed: int = 7) -> list[tuple[int, torch.Tensor]]:
    """(label, (1, 28, 28) uint8 image) for each of the ten classes, drawn fresh (not the training digits)."""
    images, labels = synthetic_digits(200, seed=seed)
    first = {int(label): i for i, label in reversed(list(enumerate(labels)))}
    return [(k, torch.from_numpy(images[first[k]]).unsqueeze(0)) for k in range(10)]


def parse(stdout: str) -> dict[str, tuple[int, float]]:
    """The prediction lines (``FILE DIGIT PROBABILITY``) by file name; the last line is the done line."""
    lines = stdout.strip().splitlines()
    assert lines[-1] == f"done: predictions={len(lines) - 1}"
    return {path.rsplit("/", 1)[-1]: (int(digit), float(p)) for path, digit, p in (line.split() for line in lines[:-1])}


def test_digits_white_on_black_and_dark_on_paper_are_classified(checkpoint, run_inprocess, tmp_path):
    folder = tmp_path / "digits"
    folder.mkdir()
    for label, image in one_digit_per_class():
        write_png(image, str(folder / f"{label}-white.png"))
        write_png(255 - image, str(folder / f"{label}-paper.png"))  # dark ink on white paper
        write_jpeg(255 - image, str(folder / f"{label}-paper.jpg"), quality=95)
    (folder / "notes.txt").write_text("not an image: skipped, the folder's images are .png/.jpg/.jpeg")

    result = run_inprocess(RECIPE, "--predict", folder, "--resume", checkpoint)
    assert result.code == 0, result.stderr
    predictions = parse(result.stdout)
    expected = sorted(p.name for p in folder.iterdir() if p.suffix != ".txt")
    assert list(predictions) == expected  # a folder: its image files, sorted
    for name, (digit, probability) in predictions.items():
        assert digit == int(name.split("-")[0]), name
        assert 0.1 < probability <= 1.0


def test_a_blank_image_is_warned_of_and_still_predicted(checkpoint, run_inprocess, tmp_path):
    """Paper alone, large or 28x28, white or grey: the model names a digit for it, so the user is told."""
    digit = dict(one_digit_per_class())[4]
    write_png(255 - digit, str(tmp_path / "a-digit.png"))
    write_png(torch.full((1, 120, 90), 250, dtype=torch.uint8), str(tmp_path / "b-paper.png"))
    write_png(torch.full((1, 28, 28), 128, dtype=torch.uint8), str(tmp_path / "c-grey.png"))
    result = run_inprocess(RECIPE, "--predict", tmp_path, "--resume", checkpoint)
    assert result.code == 0, result.stderr
    assert list(parse(result.stdout)) == ["a-digit.png", "b-paper.png", "c-grey.png"]  # one line each, as before
    assert result.stderr.splitlines() == [f"warning: {tmp_path / name} is blank (no digit found): its prediction "
                                          "means nothing" for name in ("b-paper.png", "c-grey.png")]


def test_colour_images_are_read_as_their_grey_levels(checkpoint, run_inprocess, tmp_path):
    """A photo is RGB: decoded to one grey channel, it gives the grey image's digit and probability."""
    for label, image in one_digit_per_class()[:4]:
        write_png(255 - image, str(tmp_path / f"{label}-grey.png"))
        rgb = torch.cat([255 - image] * 3)  # the same picture with three (equal) channels, as a photo has
        write_png(rgb, str(tmp_path / f"{label}-rgb.png"))
        write_jpeg(rgb, str(tmp_path / f"{label}-rgb.jpg"), quality=100)
    result = run_inprocess(RECIPE, "--predict", tmp_path, "--resume", checkpoint)
    assert result.code == 0, result.stderr
    predictions = parse(result.stdout)
    assert len(predictions) == 12
    for label in range(4):
        grey_digit, grey_p = predictions[f"{label}-grey.png"]
        assert grey_digit == label
        assert predictions[f"{label}-rgb.png"] == (grey_digit, grey_p)  # lossless: exactly the same
        assert predictions[f"{label}-rgb.jpg"][0] == label  # lossy JPEG: the same digit


def test_files_and_folders_in_the_order_given(checkpoint, run_inprocess, tmp_path):
    digits = dict(one_digit_per_class())
    (tmp_path / "more").mkdir()
    write_png(digits[3], str(tmp_path / "b.png"))
    write_png(digits[8], str(tmp_path / "more" / "z.png"))
    write_png(digits[1], str(tmp_path / "more" / "a.PNG"))
    write_png(digits[5], str(tmp_path / "c.png"))
    (tmp_path / "more" / "._z.png").write_bytes(b"\x00\x05\x16\x07")  # a Mac's metadata: it failed the run
    # --predict once, more images as arguments after it; or the option repeated
    for args in (["--predict", tmp_path / "b.png", tmp_path / "more", tmp_path / "c.png"],
                 ["--predict", tmp_path / "b.png", "--predict", tmp_path / "more", "--predict", tmp_path / "c.png"]):
        result = run_inprocess(RECIPE, *args, "--resume", checkpoint)
        assert result.code == 0, result.stderr
        lines = result.stdout.strip().splitlines()
        assert [line.split()[0] for line in lines[:-1]] == [str(tmp_path / p) for p in
                                                            ("b.png", "more/a.PNG", "more/z.png", "c.png")]
        assert [int(line.split()[1]) for line in lines[:-1]] == [3, 1, 8, 5]


def test_a_photo_is_inverted_cropped_and_centred_like_mnist():
    """Dark ink (a 40x20 stroke) on light grey paper in a 120x90 photo -> white on black, the bounding box
    scaled to 20 pixels high and centred in 28x28."""
    photo = torch.full((1, 120, 90), 200, dtype=torch.uint8)
    photo[0, 10:50, 60:80] = 30  # top right, far from the centre
    x = mnist.to_mnist_format(photo)
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32
    rows, cols = torch.nonzero(x[0] > 0.5, as_tuple=True)
    assert (rows.min().item(), rows.max().item()) == (4, 23)  # 20 rows, 4 above and below
    assert (cols.min().item(), cols.max().item()) == (9, 18)  # 10 columns: the aspect ratio kept, centred
    assert x[0, :4].max() == 0 and x[0, 24:].max() == 0  # black background
    assert x.max() == 1.0  # the ink at full brightness


def test_images_are_read_without_torchvision_s_deprecated_decoders(tmp_path):
    """torchvision.io's decode_image is deprecated since torchvision 0.29 (to be removed): a copy of the recipe
    would have taught it, and broken with a later torchvision. Pillow reads the files instead."""
    import warnings

    from PIL import Image

    image = one_digit_per_class()[3][1][0].numpy()
    Image.fromarray(image).save(tmp_path / "digit.png")
    Image.fromarray(image).save(tmp_path / "digit.jpg", quality=95)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        png, jpeg = mnist.read_digit(tmp_path / "digit.png"), mnist.read_digit(tmp_path / "digit.jpg")
    assert png.sum() > 0 and (png - jpeg).abs().max() < 0.1


def test_a_digit_is_placed_by_its_centre_of_mass_as_mnist_s_are():
    """An L-shaped stroke: its bounding box was centred, as MNIST does not; MNIST puts the centre of mass there."""
    photo = torch.zeros((1, 140, 140), dtype=torch.uint8)
    photo[0, 20:120, 20:40], photo[0, 100:120, 20:120] = 255, 255  # an L: most of its ink low and left
    x = mnist.to_mnist_format(photo)[0]
    rows, cols = torch.arange(28, dtype=torch.float32), torch.arange(28, dtype=torch.float32)
    centre = ((x.sum(1) * rows).sum() / x.sum(), (x.sum(0) * cols).sum() / x.sum())
    assert abs(centre[0] - 13.5) <= 0.5 and abs(centre[1] - 13.5) <= 0.5, centre
    inked = torch.nonzero(x > 0.5)
    (top, left), (bottom, right) = inked.min(0).values.tolist(), inked.max(0).values.tolist()
    assert bottom - top == right - left == 19  # the whole 20x20 digit, inside the frame
    assert (top, left) != (4, 4)  # not where its bounding box would be centred (4..23 both ways)


def test_a_16_bit_png_gives_the_digit_of_its_8_bit_copy(checkpoint, run_inprocess, tmp_path):
    """16-bit PNGs decode to uint16: divided by 255 as if 8-bit, 8 digits in 10 came out wrong at probability 1."""
    from PIL import Image

    for label, image in one_digit_per_class():
        write_png(image, str(tmp_path / f"{label}-8.png"))
        Image.fromarray(image[0].numpy().astype("uint16") * 257).save(tmp_path / f"{label}-16.png")  # mode I;16
    assert torch.equal(mnist.read_digit(tmp_path / "3-16.png"), mnist.read_digit(tmp_path / "3-8.png"))
    predictions = parse(run_inprocess(RECIPE, "--predict", tmp_path, "--resume", checkpoint).stdout)
    for label in range(10):
        assert predictions[f"{label}-16.png"] == predictions[f"{label}-8.png"]


def test_palette_and_1_bit_pngs_read_as_their_grey_copy(tmp_path):
    """torchvision's (grey, alpha) of a palette PNG was made-up memory (another digit each run), and a 1-bit PNG's
    alpha was 1 of 255: nearly see-through, so it read as a blank image."""
    import numpy as np
    from PIL import Image

    for _, image in one_digit_per_class()[:3]:
        ink = Image.fromarray(((image[0] > 128) * 255).to(torch.uint8).numpy())  # black and white: no shade is lost
        ink.save(tmp_path / "grey.png")
        ink.convert("P").save(tmp_path / "palette.png")
        ink.convert("1").save(tmp_path / "1-bit.png")
        grey = mnist.read_digit(tmp_path / "grey.png")
        assert grey.sum() > 0
        for name in ("palette.png", "1-bit.png"):
            assert torch.equal(mnist.read_digit(tmp_path / name), grey), name
        # a palette with a see-through colour (tRNS): black ink on a transparent canvas, as RGBA reads it
        ink_array = np.asarray(ink)
        canvas = Image.fromarray(np.stack([np.zeros_like(ink_array)] * 3 + [ink_array], axis=-1))
        canvas.save(tmp_path / "rgba.png")
        canvas.convert("P").save(tmp_path / "palette-trns.png")
        assert torch.equal(mnist.read_digit(tmp_path / "palette-trns.png"), mnist.read_digit(tmp_path / "rgba.png"))
        assert mnist.read_digit(tmp_path / "rgba.png").sum() > 0


def test_a_digit_on_a_transparent_canvas_reads_as_its_ink(tmp_path):
    """A drawing app's PNG: ink, black or white, whose pixels are opaque on a transparent canvas whose own colour is
    black. Read as grey alone, black ink came out blank (a black digit on black)."""
    import numpy as np
    from PIL import Image

    for _, image in one_digit_per_class()[:3]:
        write_png(image, str(tmp_path / "white-on-black.png"))
        ink = image[0].numpy()
        for shade in (0, 255):
            rgba = np.stack([np.full_like(ink, shade)] * 3 + [ink], axis=-1)
            Image.fromarray(rgba, "RGBA").save(tmp_path / f"{shade}.png")
            torch.testing.assert_close(mnist.read_digit(tmp_path / f"{shade}.png"),  # 1 - (1 - x): within float's
                                       mnist.read_digit(tmp_path / "white-on-black.png"), atol=1e-6, rtol=0)
    Image.fromarray(np.stack([ink, np.full_like(ink, 255)], axis=-1), "LA").save(tmp_path / "opaque.png")
    assert torch.equal(mnist.read_digit(tmp_path / "opaque.png"), mnist.read_digit(tmp_path / "white-on-black.png"))


def test_a_phone_photo_is_turned_upright_as_its_exif_orientation_says(checkpoint, run_inprocess, tmp_path):
    """A phone stores a portrait photo's pixels sideways and says so in EXIF (Orientation 6: turn 90 degrees
    clockwise); read as stored, the digit was sideways, and another digit was predicted."""
    from PIL import Image

    for label, image in one_digit_per_class():
        upright = Image.fromarray(255 - image[0].numpy())  # dark ink on paper, as photographed
        upright.save(tmp_path / f"{label}-upright.jpg", quality=100)
        exif = Image.Exif()
        exif[0x0112] = 6  # Orientation
        upright.rotate(90, expand=True).save(tmp_path / f"{label}-sideways.jpg", quality=100, exif=exif)
    upright, sideways = (mnist.read_digit(tmp_path / f"7-{name}.jpg") for name in ("upright", "sideways"))
    assert (upright - sideways).abs().max() < 0.1  # the same picture, but for JPEG's loss
    predictions = parse(run_inprocess(RECIPE, "--predict", tmp_path, "--resume", checkpoint).stdout)
    for label in range(10):
        assert predictions[f"{label}-sideways.jpg"][0] == predictions[f"{label}-upright.jpg"][0] == label


def test_an_image_named_in_another_encoding_is_read(tmp_path):
    """torchvision's read_file refused the name (a lone surrogate): "not a readable PNG or JPEG image"."""
    import os

    image = one_digit_per_class()[0][1]
    write_png(image, str(tmp_path / "plain.png"))
    latin = tmp_path / os.fsdecode(b"caf\xe9.png")
    latin.write_bytes((tmp_path / "plain.png").read_bytes())
    assert torch.equal(mnist.read_digit(latin), mnist.read_digit(tmp_path / "plain.png"))


def test_a_28x28_image_is_kept_as_it_is_framed_on_black_and_its_paper_made_black():
    digit = torch.zeros(1, 28, 28, dtype=torch.uint8)
    digit[0, 6:22, 12:16], digit[0, 6:22, 11] = 255, 128  # a "1" with an anti-aliased edge, as MNIST's are
    assert torch.equal(mnist.to_mnist_format(digit), digit.float() / 255)
    assert torch.allclose(mnist.to_mnist_format(255 - digit), digit.float() / 255)
    # ink of 20 on paper of 235: the background stayed 0.078, a grey the model reads as ink (2 digits in 20 right)
    on_paper = (235 - digit.float() / 255 * (235 - 20)).round().to(torch.uint8)
    assert torch.allclose(mnist.to_mnist_format(on_paper), digit.float() / 255, atol=1 / 200)


def test_paper_darker_than_mid_grey_is_still_the_paper():
    """A photo in dim light: paper of 110, ink of 20. Its border is below 0.5, so it was taken for MNIST's black
    background and not inverted (a 7 read as an 8)."""
    photos = [torch.full((1, 120, 90), paper, dtype=torch.uint8) for paper in (200, 110)]
    for photo, ink in zip(photos, (30, 20), strict=True):
        photo[0, 10:50, 60:80] = ink
    on_white, in_dim_light = (mnist.to_mnist_format(photo) for photo in photos)
    assert on_white.max() == 1.0 and torch.allclose(in_dim_light, on_white)


def test_a_thin_pen_stroke_is_at_full_brightness_after_the_downscale():
    """A 7 drawn 4 pixels wide in a 400x300 picture: scaled by 1/15 the stroke averaged to 0.27 with the paper
    beside it, a faint hairline the model read as a 1. MNIST's ink is at full brightness."""
    photo = torch.full((1, 400, 300), 255, dtype=torch.uint8)
    photo[0, 50:54, 50:250], photo[0, 50:350, 246:250] = 0, 0
    x = mnist.to_mnist_format(photo)
    assert x.max() == 1.0 and (x > 0.5).sum() >= 20  # a stroke along the bar and down the stem


@pytest.mark.parametrize("args", [["--compile", "true"], ["--epochs", 2, 3]])
def test_an_extra_argument_without_predict_is_named_not_blamed_on_predict(run_inprocess, args, tmp_path):
    """--compile takes no value, so `true` was read as an image: "Invalid value for --predict: ... not --compile"."""
    result = run_inprocess(RECIPE, *args, "--run-dir", tmp_path / "run")
    assert result.code == 2 and "--predict: predicts" not in result.stderr
    assert f"Invalid value for IMAGE: unexpected extra argument '{args[-1]}' (a flag such as --compile takes no " \
        "value; images to predict follow --predict)" in " ".join(result.stderr.split()), result.stderr
    assert not (tmp_path / "run").exists()


def png_header(width: int, height: int, pixels: bytes = b"", *, interlaced: bool = False, packed: bytes | None = None,
               crc_flip: int = 0) -> bytes:
    """An 8-bit grey PNG saying its size, with ``pixels`` (rows of a filter byte and the pixels, pass after pass when
    ``interlaced``) as its image data (``packed``: as compressed already), or none at all: a picture too big to build
    here. ``crc_flip``: bits flipped in the image data's CRC."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes, flip: int = 0) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) ^ flip)

    idat = packed if packed is not None else zlib.compress(pixels) if pixels else b""
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, interlaced)) + \
        chunk(b"IDAT", idat, crc_flip) + chunk(b"IEND", b"")


def interlaced_bytes(width: int, height: int) -> int:
    """The image data of an interlaced 8-bit grey PNG: each of the 7 passes (the PNG standard's table) holds the
    pixels at its first column and row and every step after them; a row is a filter byte and those pixels."""
    passes = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]
    return sum(len(range(y, height, dy)) * (1 + len(range(x, width, dx))) for x, y, dx, dy in passes
               if len(range(x, width, dx)))


@pytest.mark.parametrize(("width", "height"), [(28, 28), (1, 5), (5, 1), (3, 30), (13, 7)])
def test_a_whole_interlaced_png_is_read_and_one_cut_short_is_refused(width, height, tmp_path):
    """Interlaced PNGs hold their pixels in 7 passes; a file cut anywhere in them (a download cut off) is refused."""
    whole = png_header(width, height, bytes(interlaced_bytes(width, height)), interlaced=True)
    (tmp_path / "whole.png").write_bytes(whole)
    assert mnist.read_digit(tmp_path / "whole.png").shape == (1, 28, 28)
    for cut in range(len(whole) - 13, 33, -1):  # from the image data's checksum (IEND is the last 12 bytes) back
        (tmp_path / "short.png").write_bytes(whole[:cut])
        with pytest.raises(mnist.cli.RecipeError, match="short.png is not a readable PNG or JPEG image"):
            mnist.read_digit(tmp_path / "short.png")


@pytest.mark.parametrize("case", ["not an image", "empty file", "empty folder", "missing file", "text only folder",
                                  "gif", "too many pixels", "a decompression bomb", "pixels cut short", "a bad CRC",
                                  "a row filter PNG has not", "no image data"])
def test_bad_images_are_one_line_errors(case, checkpoint, run_inprocess, tmp_path):
    if case == "gif":  # torchvision decodes it, but in colour whatever mode is asked: the model wants one channel
        from PIL import Image

        Image.new("L", (28, 28)).save(tmp_path / "digit.gif")
        target, text = tmp_path / "digit.gif", "digit.gif is not a readable PNG or JPEG image"
    elif case in ("too many pixels", "a decompression bomb"):  # decoded, they ran out of memory: an abort, or killed
        size = (9000, 9000) if case == "too many pixels" else (20000, 20000)  # Pillow refuses past 179M pixels
        (tmp_path / "huge.png").write_bytes(png_header(*size))
        target, text = tmp_path / "huge.png", ("huge.png is 9000 x 9000 pixels, over 64,000,000: scale it down"
                                               if case == "too many pixels" else "is not a readable PNG or JPEG image")
    elif case in ("pixels cut short", "a bad CRC", "a row filter PNG has not", "no image data"):
        # (damage that libpng's error on was a segfault in torchvision's decoder, which the recipe once used; a
        # PNG without an IDAT chunk, an IndexError traceback in Pillow's check)
        whole = png_header(28, 28, bytes(29) * 28)
        idat = whole.index(b"IDAT") - 4
        damaged = {"pixels cut short": whole[:-20],  # a download cut off
                   "a bad CRC": png_header(28, 28, bytes(29) * 28, crc_flip=1),
                   "a row filter PNG has not": png_header(28, 28, b"\x09" + bytes(29 * 28 - 1)),
                   "no image data": whole[:idat] + whole[idat + 12 + int.from_bytes(whole[idat : idat + 4], "big"):]}
        (tmp_path / "damaged.png").write_bytes(damaged[case])
        target, text = tmp_path / "damaged.png", "damaged.png is not a readable PNG or JPEG image"
    elif case == "not an image":
        (tmp_path / "digit.png").write_text("this is text, not a PNG")
        target, text = tmp_path / "digit.png", "digit.png is not a readable PNG or JPEG image"
    elif case == "empty file":
        (tmp_path / "digit.jpg").write_bytes(b"")
        target, text = tmp_path / "digit.jpg", "digit.jpg is not a readable PNG or JPEG image"
    elif case == "empty folder":
        (tmp_path / "none").mkdir()
        target, text = tmp_path / "none", "the folder holds no .png, .jpg or .jpeg files"
    elif case == "text only folder":
        (tmp_path / "docs").mkdir()
        (tmp_path / "docs" / "readme.txt").write_text("hi")
        target, text = tmp_path / "docs", "the folder holds no .png, .jpg or .jpeg files"
    else:
        target, text = tmp_path / "nope.png", "nope.png: no such file or folder"
    result = run_inprocess(RECIPE, "--predict", target, "--resume", checkpoint)
    assert result.code == 1
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1 and text in result.stderr, \
        result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_a_checkpoint_of_another_recipe_is_refused(run_inprocess, table_csv, tmp_path):
    image = tmp_path / "d.png"
    write_png(one_digit_per_class()[0][1], str(image))
    result = run_inprocess("tabular_mlp", "--csv", table_csv, "--target", "label", "--epochs", 1,
                           "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    result = run_inprocess(RECIPE, "--predict", image, "--resume", tmp_path / "run" / "checkpoints" / "last.pt")
    assert result.code == 1 and "written by recipe 'tabular_mlp', not 'mnist_onecycle'" in result.stderr


@pytest.mark.parametrize("config", [None, {}, {"width": "8"}, {"width": 0}])
def test_a_checkpoint_without_its_width_is_a_one_line_error(config, run_inprocess, tmp_path):
    image, path = tmp_path / "d.png", tmp_path / "m.pt"
    write_png(one_digit_per_class()[0][1], str(image))
    torch.save({"recipe": RECIPE, "model": {}, "step": 0, **({} if config is None else {"config": config})}, path)
    result = run_inprocess(RECIPE, "--predict", image, "--resume", path)
    assert (result.code, result.stderr) == (1, f"error: checkpoint {path} records no --width: another version of "
                                               "this recipe wrote it\n")


@pytest.mark.parametrize(("args", "text"), [
    (["--predict", "d.png"], "Invalid value for --resume"),
    (["--predict", "d.png", "--resume", "auto"], "Invalid value for --resume"),
    (["--predict", "", "--resume", "m.pt"], "Invalid value for '--predict': is empty; give an image file or a folder"),
    (["--predict", "d.png", " ", "--resume", "m.pt"], "Invalid value for 'IMAGE': is empty; give an image file"),
    (["stray.png"], "unexpected extra argument 'stray.png' (a flag such as --compile takes no value; images to "
                    "predict follow --predict)"),
    # training options do nothing to a prediction: refused, not silently ignored
    (["--predict", "d.png", "--resume", "m.pt", "--epochs", "5", "--precision=bf16"],
     "Invalid value for --predict: predicts with the checkpoint's model on --device: not --epochs, --precision"),
    (["--predict", "d.png", "--resume", "m.pt", "--no-augment"], "not --augment"),
])
def test_usage_errors(args, text, run_inprocess):
    result = run_inprocess(RECIPE, *args)
    assert result.code == 2 and text in " ".join(result.stderr.split()), result.stderr


def test_a_card_with_a_see_through_margin_reads_as_the_card(tmp_path):
    """A digit card (dark ink on light paper) centred on a transparent canvas: its margin was laid on the shade the
    card's mean is not (black), so the whole card read as the digit. Grey and RGB PNGs with one see-through colour
    (a tRNS chunk, as optipng writes them) had their transparency ignored."""
    import numpy as np
    from PIL import Image

    for _, image in one_digit_per_class()[:3]:
        card = 230 - (image[0].numpy().astype(np.int32) * 200 // 255).astype(np.uint8)  # paper 230, ink down to 30
        card = np.kron(card, np.ones((4, 4), np.uint8))  # 112 x 112, as a scan would be
        Image.fromarray(card).save(tmp_path / "plain.png")
        grey, alpha = np.zeros((160, 160), np.uint8), np.zeros((160, 160), np.uint8)
        grey[24:136, 24:136], alpha[24:136, 24:136] = card, 255
        for stored in (0, 255):  # what the see-through pixels hold, which no viewer shows
            Image.fromarray(np.stack([np.where(alpha > 0, grey, stored), alpha], axis=-1), "LA").save(
                tmp_path / f"margin-{stored}.png")
        keyed = np.where(alpha > 0, np.maximum(grey, 1), 0).astype(np.uint8)  # 0: the see-through colour
        Image.fromarray(keyed).save(tmp_path / "grey-trns.png", transparency=0)
        Image.fromarray(keyed).convert("RGB").save(tmp_path / "rgb-trns.png", transparency=(0, 0, 0))
        Image.fromarray(keyed.astype(np.uint16) * 257).save(tmp_path / "grey16-trns.png", transparency=0)
        plain = mnist.read_digit(tmp_path / "plain.png")
        assert plain.sum() > 0
        for name in ("margin-0.png", "margin-255.png", "grey-trns.png", "rgb-trns.png", "grey16-trns.png"):
            torch.testing.assert_close(mnist.read_digit(tmp_path / name), plain, atol=1e-6, rtol=0, msg=name)


def test_a_2_and_4_bit_grey_png_s_see_through_shade_is_see_through(tmp_path):
    """Pillow stretches a 2- or 4-bit grey PNG's pixels to 8 bits but not its tRNS key: no pixel matched it, so a
    card's see-through margin read as ink (a filled square for a digit)."""
    import numpy as np
    from PIL import Image

    levels = np.where(np.indices((40, 40)).sum(0) % 3, 3, 0)  # shades 0 and 3 of a 2-bit grey
    levels[:6], levels[-6:], levels[:, :6], levels[:, -6:] = 1, 1, 1, 1  # a margin of shade 1, see-through
    for bits in (2, 4):
        stretch = 255 // (2**bits - 1)
        Image.fromarray((levels * stretch).astype(np.uint8)).save(tmp_path / "8.png", transparency=stretch)
        Image.fromarray((levels * stretch).astype(np.uint8)).save(tmp_path / f"{bits}.png", bits=bits, transparency=1)
        data = (tmp_path / f"{bits}.png").read_bytes()
        assert data[24] == bits and data[data.index(b"tRNS") + 4 : data.index(b"tRNS") + 6] == b"\x00\x01"  # raw
        torch.testing.assert_close(mnist.read_digit(tmp_path / f"{bits}.png"), mnist.read_digit(tmp_path / "8.png"),
                                   atol=1e-6, rtol=0, msg=f"{bits} bits")


def test_an_unreadable_file_is_an_error_line_after_the_others_predictions(checkpoint, run_inprocess, tmp_path):
    """One cut-off file in a folder stopped every prediction: one error, and no line for the good images."""
    for label, image in one_digit_per_class()[:4]:
        write_png(image, str(tmp_path / f"{label}.png"))
    (tmp_path / "1.png").write_bytes((tmp_path / "1.png").read_bytes()[:60])  # a download cut off
    (tmp_path / "3.jpg").write_text("a HEIC photo under a .jpg name, say")
    result = run_inprocess(RECIPE, "--predict", tmp_path, "--resume", checkpoint)
    assert result.code == 1
    assert list(parse(result.stdout)) == ["0.png", "2.png", "3.png"]  # the readable ones, each predicted
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path / name} is not a readable PNG or JPEG image"
                                                  for name in ("1.png", "3.jpg")]
    only_bad = run_inprocess(RECIPE, "--predict", tmp_path / "3.jpg", "--resume", checkpoint)
    assert only_bad.code == 1 and only_bad.stdout.strip() == "done: predictions=0"
    assert only_bad.stderr.strip() == f"error: {tmp_path / '3.jpg'} is not a readable PNG or JPEG image"


def test_a_drawing_whose_soft_edge_is_lighter_as_well_as_see_through_keeps_its_ink(tmp_path):
    """Black ink blended toward white at its anti-aliased edge, as some apps save it: the card rule took the light
    edge for paper inside a card and laid the drawing on black, losing a third of its ink."""
    import numpy as np
    from PIL import Image

    rows, cols = np.mgrid[:100, :100]
    distance = np.hypot(rows - 50, cols - 50)
    alpha = (255 * np.clip(np.minimum(distance - 22, 38 - distance) + 0.5, 0, 1)).round()  # a thick 0, one soft pixel
    grey = (255 - alpha).astype(np.uint8)  # the colour blended like the alpha
    Image.fromarray(np.stack([grey, alpha.astype(np.uint8)], axis=-1), "LA").save(tmp_path / "drawing.png")
    seen = (grey * alpha / 255 + 255 - alpha).round().astype(np.uint8)  # as a viewer shows it, on white
    Image.fromarray(seen).save(tmp_path / "seen.png")
    drawing, expected = mnist.read_digit(tmp_path / "drawing.png"), mnist.read_digit(tmp_path / "seen.png")
    torch.testing.assert_close(drawing, expected, atol=1e-6, rtol=0)  # its ink was 90 of 201
