/* The CBOR encoding of each block's token ids, for pdpatch.hashing.encoders.
 *
 * vLLM hashes block i as F(cbor2.dumps((parent, tuple(tokens[i*B:(i+1)*B]), extra))).  The
 * part that depends on the tokens is the array's items: each id encoded as a CBOR unsigned
 * integer, shortest form (RFC 8949 4.2.1; cbor2 always writes that form).  This module writes
 * those items for every block in one call, so no per-block Python work is left but the digest.
 *
 * It answers None -- the caller then takes the pure-Python paths, which decide exactly as
 * cbor2 does -- for anything that is not a list/tuple of exact ints in [0, 2**63): bools, int
 * subclasses, numpy scalars, negative or larger ids.  It never calls back into Python while it
 * reads the list, so the list cannot change under it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static Py_ssize_t put_uint(unsigned char *out, unsigned long long v)
{
    if (v < 24) {
        out[0] = (unsigned char)v;
        return 1;
    }
    if (v < 0x100) {
        out[0] = 0x18;
        out[1] = (unsigned char)v;
        return 2;
    }
    if (v < 0x10000) {
        out[0] = 0x19;
        out[1] = (unsigned char)(v >> 8);
        out[2] = (unsigned char)v;
        return 3;
    }
    if (v < 0x100000000ULL) {
        out[0] = 0x1a;
        for (int i = 0; i < 4; i++)
            out[1 + i] = (unsigned char)(v >> (24 - 8 * i));
        return 5;
    }
    out[0] = 0x1b;
    for (int i = 0; i < 8; i++)
        out[1 + i] = (unsigned char)(v >> (56 - 8 * i));
    return 9;
}

PyDoc_STRVAR(block_items_doc,
"block_items(tokens, count, block_size) -> list[bytes] | None\n\n"
"The CBOR items (no array header) of the token ids of each of the first ``count`` blocks of\n"
"``block_size`` ids; None unless ``tokens`` is a list or tuple of exact ints in [0, 2**63).");

static PyObject *block_items(PyObject *self, PyObject *args)
{
    PyObject *tokens;
    Py_ssize_t count, block_size;
    if (!PyArg_ParseTuple(args, "Onn:block_items", &tokens, &count, &block_size))
        return NULL;
    if (count < 0 || block_size < 1) {
        PyErr_SetString(PyExc_ValueError, "count must be >= 0 and block_size >= 1");
        return NULL;
    }
    if (!PyList_CheckExact(tokens) && !PyTuple_CheckExact(tokens))
        Py_RETURN_NONE;
    Py_ssize_t available = PySequence_Fast_GET_SIZE(tokens);
    if (count > available / block_size) {
        PyErr_SetString(PyExc_ValueError, "tokens holds fewer than count * block_size ids");
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(tokens);
    unsigned char *buf = PyMem_Malloc((size_t)block_size * 9);
    if (buf == NULL)
        return PyErr_NoMemory();
    PyObject *out = PyList_New(count);
    if (out == NULL) {
        PyMem_Free(buf);
        return NULL;
    }
    for (Py_ssize_t b = 0; b < count; b++) {
        PyObject **block = items + b * block_size;
        Py_ssize_t len = 0;
        for (Py_ssize_t i = 0; i < block_size; i++) {
            PyObject *item = block[i];
            int overflow = 0;
            long long v = PyLong_CheckExact(item) ? PyLong_AsLongLongAndOverflow(item, &overflow)
                                                  : -1;
            if (v < 0 || overflow) {       /* not an exact int, negative, or >= 2**63 */
                PyErr_Clear();
                Py_DECREF(out);
                PyMem_Free(buf);
                Py_RETURN_NONE;
            }
            len += put_uint(buf + len, (unsigned long long)v);
        }
        PyObject *encoded = PyBytes_FromStringAndSize((const char *)buf, len);
        if (encoded == NULL) {
            Py_DECREF(out);
            PyMem_Free(buf);
            return NULL;
        }
        PyList_SET_ITEM(out, b, encoded);
    }
    PyMem_Free(buf);
    return out;
}

static PyMethodDef methods[] = {
    {"block_items", block_items, METH_VARARGS, block_items_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pdpatch.hashing._cbor_blocks",
    "CBOR items of block token ids (see pdpatch.hashing.encoders).", -1, methods,
};

PyMODINIT_FUNC PyInit__cbor_blocks(void)
{
    return PyModule_Create(&module);
}
