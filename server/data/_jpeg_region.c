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
 * The GIL is released while libjpeg works. Built by setuptools as an optional extension
 * (pyproject.toml); server/data/scaled_jpeg.py decodes whole images when it is missing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
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
        jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
        jpeg_read_header(&cinfo, TRUE);
        cinfo.out_color_space = JCS_RGB;
        cinfo.scale_num = (unsigned int)m;
        cinfo.scale_denom = 8;
        jpeg_start_decompress(&cinfo);
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
        jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
        jpeg_read_header(&cinfo, TRUE);
        cinfo.scale_num = (unsigned int)(m < 1 ? 1 : (m > 8 ? 8 : m));
        cinfo.scale_denom = 8;
        jpeg_start_decompress(&cinfo);
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

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(data, m, x, y, w, h) -> (pixels, x0, width): rows y..y+h-1, columns x0..x0+width-1 (x0 <= x, "
     "width >= w + x - x0) of the JPEG decoded at m/8, uint8 RGB; only the MCUs covering them are decoded."},
    {"entropy", entropy, METH_VARARGS,
     "entropy(data, m, rows): the first rows of the JPEG at m/8 skipped (entropy-decoded only): a measuring aid."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg_region", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpeg_region(void) { return PyModule_Create(&module); }
