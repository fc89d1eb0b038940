/* A JPEG's region decoded at m/8 of its size with libjpeg-turbo's libjpeg API, to RGB.
 *
 * decode(data, m, x, y, w, h) -> (pixels: bytearray, x0: int, width: int)
 *
 *   data     the JPEG file's bytes (any object with the buffer protocol)
 *   m        the scale m/8 (1..8): libjpeg's scale_num / scale_denom
 *   x, y     the region's top-left corner, pixels of the image decoded at m/8
 *   w, h     its width and height, pixels of the image decoded at m/8
 *
 * Only the region's MCU rows and columns are decoded, as libjpeg-turbo's djpeg -crop and
 * TensorFlow's decode_and_crop_jpeg do: jpeg_skip_scanlines passes the rows above it (their
 * entropy-coded data is read, nothing else), jpeg_crop_scanline limits the inverse DCT, upsampling
 * and colour conversion to the iMCU columns that cover it, and decoding stops after its last row.
 * The columns come out from x0 <= x (the iMCU boundary libjpeg-turbo moved x to) for width >= w
 * + (x - x0) pixels: `pixels` is uint8 [h, width, 3] RGB, rows y .. y+h-1 of the scaled image,
 * decoded straight into the bytearray returned (allocated once libjpeg has said its width).
 *
 * Raises ValueError for a region outside the scaled image or an m outside 1..8, and RuntimeError
 * with libjpeg's message for a JPEG it cannot decode (the caller falls back to a whole decode).
 *
 * entropy(data, m, rows) -> None: a measuring aid (bench/probes/region_cpu.py): what decoding the
 * first `rows` rows costs at least, their entropy-coded data read and nothing else (jpeg_skip_scanlines).
 *
 * index(data) -> (jpeg: bytes, offsets: bytes, mcu_w, mcu_h, mcus_x, mcus_y, width, height)
 *
 *   The JPEG rewritten losslessly (jpeg_read_coefficients + jpeg_write_coefficients, as jpegtran
 *   does: the same DCT coefficients, so every decode of it gives the pixels of the same decode of
 *   `data`) as a baseline JPEG with a restart marker before every MCU (DRI = 1) and optimised
 *   Huffman tables; `offsets` is int32 [mcus_x * mcus_y + 1]: where each MCU's entropy-coded data
 *   begins in `jpeg` (after its restart marker), then the end-of-image marker's end. mcu_w x mcu_h:
 *   an MCU's size in pixels; width x height: the image's. No other marker is kept (EXIF, ICC).
 *
 * extract(jpeg, offsets, mcus_x, mcus_y, mcu_w, mcu_h, width, height, c0, c1, r0, r1) -> bytes
 *
 *   A JPEG of MCU columns c0..c1 and rows r0..r1 of an index()ed JPEG, without decoding anything:
 *   its header with the frame's size changed, the MCUs' entropy-coded data copied row by row and
 *   the restart markers renumbered. A restart resets every predictor, so each MCU decodes alone:
 *   only the rectangle's Huffman data is read, where decode() reads every row above its region and
 *   the whole width of its rows. Its last column and row end where the image ends when they are
 *   the image's own (the upsampling at that edge as in the whole image).
 *
 * The GIL is released while libjpeg works. Built by setuptools as an optional extension
 * (pyproject.toml); server/data/scaled_jpeg.py decodes whole images when it is missing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

struct error_mgr {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void error_exit(j_common_ptr cinfo) {
    struct error_mgr *err = (struct error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void output_message(j_common_ptr cinfo) { (void)cinfo; } /* warnings: as OpenCV, decode what is there */

/* A decompressor whose errors longjmp to err->jump with their message (the caller calls setjmp). */
static void create(struct jpeg_decompress_struct *cinfo, struct error_mgr *err) {
    memset(cinfo, 0, sizeof(*cinfo));
    cinfo->err = jpeg_std_error(&err->pub);
    err->pub.error_exit = error_exit;
    err->pub.output_message = output_message;
    err->message[0] = '\0';
    jpeg_create_decompress(cinfo);
}

/* Read `data`'s header and start decompressing at m/8 (errors longjmp, as create()'s). */
static void start(struct jpeg_decompress_struct *cinfo, const Py_buffer *data, int m, int rgb) {
    jpeg_mem_src(cinfo, (const unsigned char *)data->buf, (unsigned long)data->len);
    jpeg_read_header(cinfo, TRUE);
    if (rgb)
        cinfo->out_color_space = JCS_RGB;
    cinfo->scale_num = (unsigned int)m;
    cinfo->scale_denom = 8;
    jpeg_start_decompress(cinfo);
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer data;
    int m, x, y, w, h;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*iiiii", &data, &m, &x, &y, &w, &h))
        return NULL;
    if (m < 1 || m > 8 || x < 0 || y < 0 || w < 1 || h < 1) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "bad region: m=%d x=%d y=%d w=%d h=%d", m, x, y, w, h);
        return NULL;
    }
    struct jpeg_decompress_struct cinfo;
    struct error_mgr err;
    PyObject *volatile out = NULL; /* volatile: set after setjmp, read after a longjmp */
    JSAMPROW row;
    JDIMENSION x0 = (JDIMENSION)x, width = (JDIMENSION)w;
    volatile int failed = 0, bad_region = 0;
    volatile unsigned int out_w = 0, out_h = 0;

    create(&cinfo, &err);
    Py_BEGIN_ALLOW_THREADS
    if (setjmp(err.jump)) {
        failed = 1;
    } else {
        start(&cinfo, &data, m, 1);
        out_w = cinfo.output_width;
        out_h = cinfo.output_height;
        if ((unsigned int)x + (unsigned int)w > out_w || (unsigned int)y + (unsigned int)h > out_h
            || cinfo.output_components != 3) {
            bad_region = 1;
        } else {
            if (x0 > 0 || width < out_w)
                jpeg_crop_scanline(&cinfo, &x0, &width);
            Py_BLOCK_THREADS /* the result, at its final size: libjpeg decodes into it */
            out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)h * width * 3);
            Py_UNBLOCK_THREADS
            if (out != NULL) {
                unsigned char *pixels = (unsigned char *)PyByteArray_AS_STRING(out);
                if (y > 0)
                    jpeg_skip_scanlines(&cinfo, (JDIMENSION)y);
                for (int r = 0; r < h; r++) {
                    row = pixels + (size_t)r * width * 3;
                    if (jpeg_read_scanlines(&cinfo, &row, 1) != 1) {
                        failed = 1;
                        strcpy(err.message, "the JPEG ended before the region's last row");
                        break;
                    }
                }
            }
        }
    }
    jpeg_destroy_decompress(&cinfo);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (failed) {
        Py_XDECREF(out);
        PyErr_SetString(PyExc_RuntimeError, err.message[0] ? err.message : "libjpeg failed");
        return NULL;
    }
    if (bad_region) {
        PyErr_Format(PyExc_ValueError, "region %dx%d+%d+%d outside the %ux%u image decoded at %d/8", w, h, x, y,
                     out_w, out_h, m);
        return NULL;
    }
    if (out == NULL)
        return NULL; /* (the allocation's MemoryError) */
    return Py_BuildValue("(Nii)", out, (int)x0, (int)width);
}

static PyObject *entropy(PyObject *self, PyObject *args) {
    Py_buffer data;
    int m, rows;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*ii", &data, &m, &rows))
        return NULL;
    struct jpeg_decompress_struct cinfo;
    struct error_mgr err;
    volatile int failed = 0;
    create(&cinfo, &err);
    Py_BEGIN_ALLOW_THREADS
    if (setjmp(err.jump)) {
        failed = 1;
    } else {
        start(&cinfo, &data, m < 1 ? 1 : (m > 8 ? 8 : m), 0);
        if (rows > 0)
            jpeg_skip_scanlines(&cinfo, (JDIMENSION)rows < cinfo.output_height ? (JDIMENSION)rows : cinfo.output_height);
    }
    jpeg_destroy_decompress(&cinfo);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (failed) {
        PyErr_SetString(PyExc_RuntimeError, err.message[0] ? err.message : "libjpeg failed");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *index_jpeg(PyObject *self, PyObject *args) {
    Py_buffer data;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*", &data))
        return NULL;
    struct jpeg_decompress_struct src;
    struct jpeg_compress_struct dst;
    struct error_mgr err;
    unsigned char *out = NULL; /* libjpeg's malloc'd output; its address is taken, so it is in memory at a longjmp */
    unsigned long outsize = 0;
    volatile int failed = 0, dst_made = 0;
    volatile int mcu_w = 0, mcu_h = 0, mx = 0, my = 0, width = 0, height = 0;

    create(&src, &err);
    memset(&dst, 0, sizeof(dst));
    dst.err = &err.pub; /* one error manager: either's error lands at err.jump */
    Py_BEGIN_ALLOW_THREADS
    if (setjmp(err.jump)) {
        failed = 1;
    } else {
        jpeg_mem_src(&src, (const unsigned char *)data.buf, (unsigned long)data.len);
        jpeg_read_header(&src, TRUE);
        jvirt_barray_ptr *coefficients = jpeg_read_coefficients(&src);
        jpeg_create_compress(&dst);
        dst_made = 1;
        jpeg_mem_dest(&dst, &out, &outsize);
        jpeg_copy_critical_parameters(&src, &dst);
        dst.restart_interval = 1;
        dst.optimize_coding = TRUE;
        jpeg_write_coefficients(&dst, coefficients);
        jpeg_finish_compress(&dst);
        if (src.num_components == 1) {
            mcu_w = mcu_h = 8; /* one component: not interleaved, an MCU is one block */
        } else {
            mcu_w = src.max_h_samp_factor * 8;
            mcu_h = src.max_v_samp_factor * 8;
        }
        width = (int)src.image_width;
        height = (int)src.image_height;
        mx = (width + mcu_w - 1) / mcu_w;
        my = (height + mcu_h - 1) / mcu_h;
        jpeg_finish_decompress(&src);
    }
    if (dst_made)
        jpeg_destroy_compress(&dst);
    jpeg_destroy_decompress(&src);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (failed) {
        free(out);
        PyErr_SetString(PyExc_RuntimeError, err.message[0] ? err.message : "libjpeg failed");
        return NULL;
    }
    Py_ssize_t n = (Py_ssize_t)mx * my, k = 0;
    PyObject *offsets = PyBytes_FromStringAndSize(NULL, (n + 1) * (Py_ssize_t)sizeof(int32_t));
    if (offsets == NULL) {
        free(out);
        return NULL;
    }
    int32_t *off = (int32_t *)PyBytes_AS_STRING(offsets);
    unsigned long p = 2, scan = 0;
    while (p + 4 <= outsize && out[p] == 0xFF) { /* the markers up to the scan's header */
        unsigned long length = ((unsigned long)out[p + 2] << 8) | out[p + 3];
        if (out[p + 1] == 0xDA) {
            scan = p + 2 + length;
            break;
        }
        p += 2 + length;
    }
    if (scan > 0 && scan < outsize && outsize < 0x7FFFFFFF) {
        off[k++] = (int32_t)scan;
        for (unsigned long i = scan; i + 1 < outsize; i++) {
            if (out[i] != 0xFF)
                continue;
            unsigned char b = out[++i]; /* 0x00: a stuffed 0xFF byte */
            if (b >= 0xD0 && b <= 0xD7 && k < n)
                off[k++] = (int32_t)(i + 1);
            else if (b == 0xD9) {
                off[n] = (int32_t)(i + 1);
                break;
            }
        }
    }
    if (k != n || off[n] <= off[n - 1]) {
        Py_DECREF(offsets);
        free(out);
        PyErr_Format(PyExc_RuntimeError, "the rewritten JPEG has %zd restart intervals where %zd were expected", k, n);
        return NULL;
    }
    PyObject *jpeg = PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)outsize);
    free(out);
    if (jpeg == NULL) {
        Py_DECREF(offsets);
        return NULL;
    }
    return Py_BuildValue("(NNiiiiii)", jpeg, offsets, (int)mcu_w, (int)mcu_h, (int)mx, (int)my, (int)width,
                         (int)height);
}

static PyObject *extract(PyObject *self, PyObject *args) {
    Py_buffer data, offb;
    int mx, my, mw, mh, width, height, c0, c1, r0, r1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*iiiiiiiiii", &data, &offb, &mx, &my, &mw, &mh, &width, &height, &c0, &c1, &r0,
                          &r1))
        return NULL;
    const unsigned char *in = (const unsigned char *)data.buf;
    const int32_t *off = (const int32_t *)offb.buf;
    const char *bad = NULL;
    Py_ssize_t n = (Py_ssize_t)mx * my;
    if (mx < 1 || my < 1 || mw < 1 || mh < 1 || offb.len != (n + 1) * (Py_ssize_t)sizeof(int32_t))
        bad = "offsets do not match the MCU grid";
    else if (c0 < 0 || c0 > c1 || c1 >= mx || r0 < 0 || r0 > r1 || r1 >= my)
        bad = "MCUs outside the image";
    else if (off[0] < 4 || off[0] > data.len || off[n] > data.len)
        bad = "offsets outside the JPEG";
    Py_ssize_t size = 0;
    for (int r = r0; bad == NULL && r <= r1; r++) { /* each MCU's data after the previous one's marker */
        for (int c = c0; bad == NULL && c <= c1; c++) {
            int32_t a = off[r * mx + c], b = off[r * mx + c + 1];
            if (a < off[0] || b - 2 < a || b > data.len)
                bad = "offsets out of order";
        }
        size += off[r * mx + c1 + 1] - off[r * mx + c0];
    }
    PyObject *result = NULL;
    if (bad == NULL)
        result = PyBytes_FromStringAndSize(NULL, off[0] + size + 2);
    if (result != NULL) {
        unsigned char *o = (unsigned char *)PyBytes_AS_STRING(result);
        Py_ssize_t head = off[0], q = head;
        int rows = (r1 == my - 1) ? height - r0 * mh : (r1 - r0 + 1) * mh;
        int cols = (c1 == mx - 1) ? width - c0 * mw : (c1 - c0 + 1) * mw;
        memcpy(o, in, (size_t)head);
        for (Py_ssize_t p = 2; p + 9 <= head && o[p] == 0xFF; p += 2 + ((o[p + 2] << 8) | o[p + 3])) {
            if (o[p + 1] >= 0xC0 && o[p + 1] <= 0xC2) { /* the frame: its size */
                o[p + 5] = (unsigned char)(rows >> 8), o[p + 6] = (unsigned char)rows;
                o[p + 7] = (unsigned char)(cols >> 8), o[p + 8] = (unsigned char)cols;
            }
        }
        int j = 0; /* restart markers count 0..7 from the scan's start */
        for (int r = r0; r <= r1; r++) {
            int32_t a = off[r * mx + c0], b = off[r * mx + c1 + 1] - 2; /* the row's MCUs, not the marker after */
            memcpy(o + q, in + a, (size_t)(b - a));
            for (int c = c0 + 1; c <= c1; c++)
                o[q + off[r * mx + c] - 1 - a] = (unsigned char)(0xD0 + (j++ & 7));
            q += b - a;
            o[q++] = 0xFF;
            o[q++] = (r == r1) ? 0xD9 : (unsigned char)(0xD0 + (j++ & 7));
        }
        if (_PyBytes_Resize(&result, q) < 0)
            result = NULL;
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&offb);
    if (bad != NULL)
        PyErr_Format(PyExc_ValueError, "extract: %s", bad);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(data, m, x, y, w, h) -> (pixels, x0, width): rows y..y+h-1, columns x0..x0+width-1 (x0 <= x, "
     "width >= w + x - x0) of the JPEG decoded at m/8, uint8 RGB; only the MCUs covering them are decoded."},
    {"entropy", entropy, METH_VARARGS,
     "entropy(data, m, rows): the first rows of the JPEG at m/8 skipped (entropy-decoded only): a measuring aid."},
    {"index", index_jpeg, METH_VARARGS,
     "index(data) -> (jpeg, offsets, mcu_w, mcu_h, mcus_x, mcus_y, width, height): the JPEG rewritten losslessly "
     "with a restart marker before every MCU, and int32 offsets of each MCU's data."},
    {"extract", extract, METH_VARARGS,
     "extract(jpeg, offsets, mcus_x, mcus_y, mcu_w, mcu_h, width, height, c0, c1, r0, r1) -> bytes: a JPEG of "
     "MCU columns c0..c1 and rows r0..r1 of an index()ed JPEG, nothing decoded."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg_region", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpeg_region(void) { return PyModule_Create(&module); }
